"""The xinserve command and its tools: serve, bench, doctor, plan."""
