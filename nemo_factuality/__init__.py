"""nemo_factuality: factuality post-training toolkit for the NeMo / Megatron-Core stack.

``import nemo_factuality`` stays light: heavy stacks (PyTriton, Megatron-Core, NeMo, vLLM)
are imported only inside the subpackages that need them.
"""

import logging
import os

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

#: How long gevent keeps an idle thread of its default pool (PyTriton's HTTP client resolves names there), in seconds.
#: gevent's own default, 5 s, retires them soon after each reward call, and a thread exiting at the instant Megatron-Core
#: forks its checkpoint writer (every dist-checkpoint save forks) leaves the child deadlocked in CPython's after-fork
#: cleanup: the writer never starts and its rank waits forever (seen on the aligner backend's final export, two ranks
#: stuck in one save). 10⁶ s (~12 days): gevent refuses -1 and "inf". Set before gevent's pool exists (it reads the
#: variable then); a value the user set wins.
GEVENT_THREAD_IDLE_S = "1000000"
os.environ.setdefault("GEVENT_THREADPOOL_IDLE_TASK_TIMEOUT", GEVENT_THREAD_IDLE_S)
