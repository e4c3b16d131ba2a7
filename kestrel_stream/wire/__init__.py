"""The daemon's socket protocol, shared by the daemon (serve/) and its clients (client/): frames, error
codes, JSON limits and where a daemon listens by default."""
