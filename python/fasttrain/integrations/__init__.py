"""fasttrain inside frameworks built on the Trainer, through their own extension points.

- ``axolotl``: ``FasttrainPlugin``, an Axolotl plugin (registered on the ``axolotl.plugins`` entry points, so
  Axolotl loads it on every run; inert unless the config says ``fasttrain: true``).

LLaMA-Factory has no plugin point for this: ``FASTTRAIN_PATCH=1 llamafactory-cli train ...`` switches fasttrain on
(``fasttrain._autopatch``), and ``fasttrain.integration.llamafactory`` serves its preference trainers.

A plugin hands the trainer a framework built to ``fasttrain.integration`` and does nothing else with it
(tests/test_architecture.py).
"""
