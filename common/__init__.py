"""Helpers both services (the gateway and the stages) use: no project imports here."""
