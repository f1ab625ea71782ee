"""The running system: Ray workers, the launcher, the gateway and the CLI."""
