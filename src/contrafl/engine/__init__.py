"""contrafl.engine"""
