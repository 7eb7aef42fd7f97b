"""The "inline" arm of issue 13's item 5 A/B (docs/BENCHMARKS.md, seventh session): with
LORAPLEX_SUBMISSIONS_INLINE=1 and this folder on PYTHONPATH, a `loraplex serve` writes each training
submission on the event loop, one transaction per submission, as before session 4, instead of on the
submission thread with group commit. Nothing else changes.

Usage (repo root), alternating the arms:
    .venv/bin/python bench/ab_servers.py --a - --b - --rounds 60 \
        --b-env "LORAPLEX_SUBMISSIONS_INLINE=1 PYTHONPATH=bench/submissions_inline"
    LORAPLEX_SUBMISSIONS_INLINE=1 PYTHONPATH=bench/submissions_inline \
        .venv/bin/loraplex bench api --rounds 12 --json | tail -1
"""

import os

if os.environ.get("LORAPLEX_SUBMISSIONS_INLINE") == "1":
    from loraplex.api.tinker.submissions import SubmissionThread
    from loraplex.runtime.control.service import Submission

    async def _inline(self, work):  # type: ignore[no-untyped-def]
        if isinstance(work, Submission):
            (outcome,) = self._service.submit_many([work])
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return work()

    SubmissionThread._hand_over = _inline  # type: ignore[method-assign]
