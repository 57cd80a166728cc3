"""Recipes: YAML files describing a whole run (see recipes/base.yaml).

The recipe's types (schema.py, with their bounds and scalar parsers) and the loader (load.py,
reader.py, values.py); they import nothing else of rlflow's, so every layer may read them. The
rules between keys, and those that ask another package, are in rlflow/rules/, which also has
`load_checked` (load, then check).
"""
