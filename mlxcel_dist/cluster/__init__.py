"""The job across processes and hosts: the launcher, the backends, hostfiles, the
heartbeat watchdog and fault injection."""
