"""ring"""
