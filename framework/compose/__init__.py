"""Composition: the recipe YAML, the schema's types and defaults, the registry of components and the
`train` command line's Hydra grammar -> one typed config (framework/compose/recipes.py)."""
