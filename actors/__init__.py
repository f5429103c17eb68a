"""ringserve's processes and everything that crosses a process boundary (`ringserve.actors`;
the public names are `ringserve`'s own: `from ringserve import Engine, Client`).

Layout (one folder per process or subsystem):

    transport/    shared-memory rings, actor processes, the launcher, every wire message,
                  SamplingParams
    frontend/     Engine and the clients; the frontend actor (actor.py: TokenizerManager, its
                  loop and reader threads) around its request table (core.py); GenerateArgs and
                  its validation (inputs.py); the IPC socket and HTTP servers
    scheduler/    the scheduler actor: batches, KV books, overlap
    runner/       the runner actor: the model on device, slot mirrors
    relay/        host 0's step messages to the other hosts
    detokenizer/  the detokenizer actor: incremental text, stop strings
    cli/          the `ringserve` command
"""
