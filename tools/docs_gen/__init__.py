"""Documentation generated from the code: ``settings`` writes the train settings' blocks of the sweep schema and
docs/settings.md from TrainConfig's field help."""
