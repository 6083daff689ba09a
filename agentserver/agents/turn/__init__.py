"""The Turn engine: the worker, a model step and its context, compaction, tool dispatch, resends, the watchdog, delivery of answers."""
