"""The contract between pipeshard processes: the shard manifest schema and the wire protocol.

Light on purpose: importable without torch or OpenVINO.
"""
