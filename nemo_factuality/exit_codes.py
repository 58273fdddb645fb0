"""Every exit code a ``nemo-factuality`` command, a stage's ``python -m`` entry and a rendered Slurm script end with,
in one place.

The command boundary (``nemo_factuality.cli.run_command``) returns them, the errors that stop a run carry them
(``exit_code``), and ``launch.render`` writes them into the sbatch template (which requeues on ``TEMPFAIL``), so a
code means one thing whether a Python process or the batch script ended with it. The docs' exit-code table is
generated from ``EXIT_CODES``; ``tests/docs`` checks that no module returns or raises a code missing from it.

``TOO_MANY_RESTARTS`` is 4: 3 is a stalled run, and the batch script must not say "stalled" for a job it merely
stopped requeueing. 4 is outside sysexits' 64–78 (76 would read as ``EX_PROTOCOL``), below the shell's own
126/127 and 128+N (killed by signal N), and no Python command of ours returns it.

>>> [c.code for c in EXIT_CODES]
[0, 1, 2, 3, 4, 75, 130, 143]
>>> by_code(75).name
'TEMPFAIL'
"""

from __future__ import annotations

from dataclasses import dataclass

OK = 0
FAILURE = 1
USER_ERROR = 2
TRAINING_STALLED = 3
TOO_MANY_RESTARTS = 4
TEMPFAIL = 75  # sysexits.h EX_TEMPFAIL
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
TERMINATED = 143  # 128 + SIGTERM


@dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    meaning: str
    what_to_do: str


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(OK, "OK", "the command did what it was asked; a training stage also exits 0 after SIGUSR1/SIGTERM "
             "once it has written its checkpoint (Slurm's requeue resumes it)", "nothing"),
    ExitCode(FAILURE, "FAILURE", "a result that is not one: `eval` with more failed records than "
             "`--max-failed-fraction` (the report is still written), `lab --quick` when a method did not raise "
             "held-out FActScore, `convert verify` above `--tol`; or a bug, printed with its traceback",
             "read the last lines; a traceback is a bug to report (rerun with `--debug` for the full one)"),
    ExitCode(USER_ERROR, "USER_ERROR", "a user error, one line `nemo-factuality <command>: error: ...`: a bad flag, "
             "override, config key or value, a missing or malformed input file, a taken port, an unknown stage or "
             "profile, a required `params.*` value left empty; always before any work is done",
             "fix what the line names and rerun"),
    ExitCode(TRAINING_STALLED, "TRAINING_STALLED", "a training stage could not learn: `trainer.max_invalid_steps` "
             "consecutive steps without one valid sample (every reward NaN, or every response truncated under "
             "`truncated=mask`), or a KTO iteration whose labeller labelled nothing; a checkpoint was written first",
             "fix the reward (judges, stores) and rerun the same command: it resumes"),
    ExitCode(TOO_MANY_RESTARTS, "TOO_MANY_RESTARTS", "the Slurm script: the job was requeued more than the launch "
             "stage's `max_restarts` times (or a server stayed away at the last allowed restart); not resumed again",
             "read the stage's log for why it kept stopping; resubmit once that is fixed (it resumes)"),
    ExitCode(TEMPFAIL, "TEMPFAIL", "a reward or critic server stayed away past `remote_rm.retry.max_wait_s` "
             "(`critic.retry.max_wait_s`) on any rank of the job, or a critic server came back at another step; the "
             "stage wrote a checkpoint (not for the critic-step mismatch) and a `REQUEUE` file in its run directory",
             "requeue: the Slurm template does it on this code or the `REQUEUE` file"),
    ExitCode(INTERRUPTED, "INTERRUPTED", "Ctrl-C (SIGINT) while the command ran: `eval`, `kb`, `convert`, `launch` and "
             "`lab` say so in one line (`<SIGNAL> received: stopping …`), stop what they started (the lab its workers "
             "and their servers, leaving `INCOMPLETE` in its output folder; `eval` writes no partial report) and exit "
             "within seconds", "rerun; a stage resumes from its latest checkpoint"),
    ExitCode(TERMINATED, "TERMINATED", "SIGTERM (`kill`) reached `eval`, `kb`, `convert`, `launch` or `lab`: as for 130 "
             "(a training stage instead checkpoints and exits 0; `serve` stops its server and exits 0)",
             "rerun the command for a report"),
)

MEANINGS: dict[int, str] = {entry.code: entry.meaning for entry in EXIT_CODES}


def by_code(code: int) -> ExitCode:
    """The table's entry for ``code`` (``KeyError`` when the code is not one this project uses)."""
    for entry in EXIT_CODES:
        if entry.code == code:
            return entry
    raise KeyError(code)
