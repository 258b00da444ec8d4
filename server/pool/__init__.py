"""The HTTP process's side of its workers: one pool per served model, a supervised client per worker process, the router, health and restarts."""
