"""Tasks built from parts (:mod:`klrl.tasks.base`), by name (``@register_task``): importing this
package registers the built-in ones (``testbed``, ``wordclass``, ``peer``)."""

from klrl.tasks import peer, testbed, wordclass  # noqa: F401  (register the built-in tasks)
