"""The launching process: checks and preparation before any worker starts (:mod:`.prepare`,
:mod:`.preflight`, :mod:`.resume`, :mod:`.pipeline`) and the supervisor that runs the job
(:mod:`.supervisor`)."""
