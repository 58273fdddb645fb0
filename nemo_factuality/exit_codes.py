"""Every exit code a ``nemo-factuality`` command (and a stage's ``python -m`` entry) ends with, in one place.

The command boundary (``nemo_factuality.cli.run_command``) turns errors into these codes; the Slurm template
(``slurm/het_job.sbatch.j2``) requeues on ``TEMPFAIL``. The docs' exit-code table is generated from
``EXIT_CODES``, and ``tests/docs`` checks that no module returns or raises a code missing from it.

>>> [c.code for c in EXIT_CODES]
[0, 1, 2, 3, 75, 130]
>>> by_code(75).name
'TEMPFAIL'
"""

from __future__ import annotations

from dataclasses import dataclass

OK = 0
FAILED = 1
USAGE = 2
STALLED = 3
TEMPFAIL = 75  # sysexits.h EX_TEMPFAIL
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


@dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    meaning: str
    what_to_do: str


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(OK, "OK", "the command did what it was asked; a training stage also exits 0 after SIGUSR1/SIGTERM "
             "once it has written its checkpoint (Slurm's requeue resumes it)", "nothing"),
    ExitCode(FAILED, "FAILED", "a result that is not one: `eval` with more failed records than "
             "`--max-failed-fraction` (the report is still written), `lab --quick` when a method did not raise "
             "held-out FActScore, `convert verify` above `--tol`; or a bug, printed with its traceback",
             "read the last lines; a traceback is a bug to report (rerun with `--debug` for the full one)"),
    ExitCode(USAGE, "USAGE", "a user error, one line `nemo-factuality <command>: error: ...`: a bad flag, override, "
             "config key or value, a missing or malformed input file, a taken port, an unknown stage or profile, a "
             "required `params.*` value left empty; always before any work is done",
             "fix what the line names and rerun"),
    ExitCode(STALLED, "STALLED", "a training stage could not learn: `trainer.max_invalid_steps` consecutive steps "
             "without one valid sample (every reward NaN, or every response truncated under `truncated=mask`), or a "
             "KTO iteration whose labeller labelled nothing; a checkpoint was written first",
             "fix the reward (judges, stores) and rerun the same command: it resumes"),
    ExitCode(TEMPFAIL, "TEMPFAIL", "a reward or critic server stayed away past `remote_rm.retry.max_wait_s` "
             "(`critic.retry.max_wait_s`), or a critic server came back at another step; the stage wrote a checkpoint "
             "(not for the critic-step mismatch) and a `REQUEUE` file in its run directory",
             "requeue: the Slurm template does it on this code or the `REQUEUE` file"),
    ExitCode(INTERRUPTED, "INTERRUPTED", "Ctrl-C (SIGINT) while the command ran", "rerun; a stage resumes from its "
             "latest checkpoint"),
)


def by_code(code: int) -> ExitCode:
    """The table's entry for ``code`` (``KeyError`` when the code is not one this project uses)."""
    for entry in EXIT_CODES:
        if entry.code == code:
            return entry
    raise KeyError(code)
