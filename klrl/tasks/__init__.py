"""Tasks built from parts (:mod:`klrl.tasks.base`), by name (``@register_task``): importing this
package registers the built-in ones (``testbed``, ``wordclass``, ``peer``, ``text``)."""

from klrl.tasks import peer, testbed, text, wordclass  # noqa: F401  (register the built-in tasks)
