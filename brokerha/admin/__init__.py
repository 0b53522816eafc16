"""brokerha.admin"""
