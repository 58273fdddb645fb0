"""Every exit code the toolkit's commands and its rendered Slurm scripts end with, in one place.

The command boundary (``nemo_factuality.cli.run_command``) returns them, the errors that stop a run carry them
(``exit_code``), and ``launch.render`` writes them into the sbatch template, so a code means one thing whether a
Python process or the batch script ended with it. ``README.md`` ("Exit codes") is this table for users.

``TOO_MANY_RESTARTS`` is 4: 3 is a stalled run, and the batch script must not say "stalled" for a job it merely
stopped requeueing. 4 is outside sysexits' 64–78 (76 would be read as ``EX_PROTOCOL``), below the shell's own
126/127 and 128+N (killed by signal N), and no command of ours returns it.
"""

from __future__ import annotations

OK = 0  # done
FAILURE = 1  # a bug (printed with its traceback), or an output that is not a result (eval, lab --quick, convert verify say why)
USER_ERROR = 2  # bad input, config, override or flag: one line on stderr
TRAINING_STALLED = 3  # trainer.max_invalid_steps steps without a valid sample (a checkpoint is written)
TOO_MANY_RESTARTS = 4  # sbatch: requeued more than the stage's max_restarts; not resuming again
TEMPFAIL = 75  # sysexits' EX_TEMPFAIL: a server stayed away past its retry window; checkpointed, requeue
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

MEANINGS: dict[int, str] = {
    OK: "done",
    FAILURE: "a bug (traceback printed), or no result: eval over --max-failed-fraction, lab --quick's check, "
             "convert verify's logits past --tol",
    USER_ERROR: "user error (input, config, override, flag): one line",
    TRAINING_STALLED: "training stalled: trainer.max_invalid_steps steps without a valid sample; checkpoint written",
    TOO_MANY_RESTARTS: "Slurm job requeued more than max_restarts times (or a server stayed away at the last one); "
                       "not resumed",
    TEMPFAIL: "temporary failure (EX_TEMPFAIL): a server stayed away past its retry window; checkpoint written, requeue",
    INTERRUPTED: "interrupted (Ctrl-C)",
}
