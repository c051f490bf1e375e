"""Adapters that let RL frameworks drive `fsdp2kit.Strategy` through their own back-end interfaces: verl's engine
(`integrations/verl.py`) and ROLL's strategy (`integrations/roll.py`). They only translate calls and batch layouts;
every computation is the Strategy's. Neither imports its framework: each is imported by the framework's user."""
