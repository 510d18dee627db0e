"""Fault-injection tests: damaged files, full disks, concurrent runs, interrupts, hostile inputs."""
