"""brokerha.client"""
