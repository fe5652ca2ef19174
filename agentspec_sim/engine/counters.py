"""The engine's counter arrays, field by field: small int64 arrays that compiled code reads and writes in place
(a NamedTuple of arrays passes by reference into numba; scalars would not), each index named here once."""

# StepBuf.sc (engine/scheduler.py): the step just scheduled.
SC_ROWS = 0  # its batch rows (call-steps)
SC_PREEMPTED = 1  # calls it preempted
SC_BOUND = 2  # what bounded it (a RUN_* / bound code of the scheduler)
SC_FINISHED = 3  # calls that finished in it
SC_SAMPLED = 4  # calls that sampled a token and go on (the drafting candidates)
SC_BAD_ROW = 5  # the row that failed the update, when it fails
SC_TOP = 6  # the largest num_computed + num_scheduled of its rows (vLLM's proposer-fits test)

# Queues.q (engine/scheduler.py).
Q_RUNNING = 0  # running calls
Q_WAITING_HEAD = 1  # the waiting ring's head
Q_WAITING = 2  # waiting calls
Q_PREEMPTIONS = 3  # preemptions so far
Q_ADMIT_LAG = 4  # steps scheduled between a step's end and the first its finished call's successor can join

# StepLog.ctr (engine/result.py): what the log holds.
LG_ROWS = 0  # call-steps
LG_STEPS = 1  # steps
LG_EVENTS = 2  # events (first tokens, finishes, preemptions, chained arrivals) not yet taken
LG_DRAFT_TOKENS = 3  # draft tokens logged

# The KV pool's ctr (engine/kv.py).
KV_FREE = 0  # free blocks
KV_NODES = 1  # prefix-hash nodes in use

# CallTable.ctr (engine/request.py).
CT_FREE_SLOTS = 0  # free running-call slots

# PersistentBatch.par (engine/scheduler.py): vLLM's persistent batch.
PB_ON = 0  # tracked at all (a drafter asked for it)
PB_ROWS = 1  # batch rows held
PB_TICK = 2  # steps seen

# DraftSlots.par (engine/drafts.py): a fast path's draft limits for the run.
DS_K_MAX = 0  # num_speculative_tokens
DS_SKIP_UNFIT = 1  # the V1 runner's proposer skip near max_model_len applies
