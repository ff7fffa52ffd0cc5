"""The memory plan of a run (`laminar plan`): memory.py makes it, trainer.py traces a trainer
rank's step, command.py is the command and the check `laminar run` makes before starting."""
