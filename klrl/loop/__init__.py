"""The training loop on the host: :func:`klrl.loop.driver.drive` steps a :class:`~klrl.loop.program.Program`
(a run or a stacked sweep); its hooks (:mod:`klrl.loop.hooks`, listed by :mod:`klrl.loop.wiring`)
checkpoint, write the metrics, samples and progress, roll back, stop on a failed reward or a signal. The run
directory's files are in :mod:`klrl.loop.files`, the stop lines in :mod:`klrl.loop.stops`, the stop and
rollback decisions in :mod:`klrl.loop.reliability`, the host-side metrics in :mod:`klrl.loop.metrics`."""
