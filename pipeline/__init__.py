"""capline's driver side: CLI, typed config, the stage runner on Ray, ledger and manifest."""
