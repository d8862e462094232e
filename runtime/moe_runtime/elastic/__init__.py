"""The resize coordinator: grows and shrinks the DP size of a serving engine, stage by stage."""
