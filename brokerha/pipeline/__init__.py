"""brokerha.pipeline"""
