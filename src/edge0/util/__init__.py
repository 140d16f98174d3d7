"""Operating-system helpers: memory, cgroups, threads, the machine, malloc."""
