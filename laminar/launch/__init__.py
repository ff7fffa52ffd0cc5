"""Process-level entry points behind the CLI, one module per job.

    run.py       `laminar run`: preflight, the run directory, one child per node, supervision
    node.py      `laminar node`: one node (or --count of them) in this process
    status.py    `laminar status`: ask the manager, print the table (and the progress client)
    tuning.py    what every node process sets: logging, gc, niceness, uvloop, import prefetch
    ipc_dir.py   the private ipc directory: made 0700 before binding, removed on the way out

run.py and node.py use tuning.py and ipc_dir.py; nothing here imports run.py or node.py.
"""
