"""The matched accuracy study on Fashion-MNIST (SSoG vs its dense twin in the discrete, looped and ODE settings),
its report (table, curves) and the step-count elasticity of the trained ODE models."""
from .runs import STUDY_PAIRS, Run, StudyPair, StudyRecipe, run_study, study_runs

__all__ = ['STUDY_PAIRS', 'StudyPair', 'Run', 'StudyRecipe', 'run_study', 'study_runs']
