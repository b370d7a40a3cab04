"""The run's configuration: the option dataclasses, the TOML file, the command line, presets and
the combinations the trainer refuses."""
