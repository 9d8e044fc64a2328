"""Running one model across several processes / Macs with ``mx.distributed``: who holds what (``plan``), pipeline
stages (``pipeline``), tensor + expert parallel module swaps (``shard``). Model files know nothing of this."""
