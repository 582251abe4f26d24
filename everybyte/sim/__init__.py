"""The fleet simulator: the engine's own control plane (EngineCore, Scheduler, KVMemoryManager)
driven on virtual clocks by a hardware cost model instead of a model forward. No torch here."""
