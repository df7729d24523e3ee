"""The control plane: boot, reload and swap (the controller, the reload plan, the swap executor), the
watchdog that restarts engines, and the admin API."""
