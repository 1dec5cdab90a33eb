"""Rollout engines behind one interface (:mod:`~megarl.engines.base`), built by name with
:func:`megarl.engines.factory.build_engine`; engine libraries are imported lazily."""
