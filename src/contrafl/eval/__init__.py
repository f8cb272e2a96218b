"""contrafl.eval"""
