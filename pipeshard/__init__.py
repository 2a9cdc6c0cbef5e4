"""The `pipeshard` command: every role (export, stage, serve, up, bench, health) wired
together, and `up`'s local fleet."""
