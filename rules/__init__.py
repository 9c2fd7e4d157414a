"""The rule library: one theme a `.rules` file, shipped as package data."""
