"""The gateway and the `pipeshard` command line."""
