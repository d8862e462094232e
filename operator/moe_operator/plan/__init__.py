"""Pure decisions of the operator: manifest builders, status computation and the resize planner."""
