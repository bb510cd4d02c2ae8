"""Models: the networks of the papers, selected by name (`zoo`), the flat-vector view used everywhere else
(`flat`, torch), and what describes a model without torch (`spec`)."""
