"""The papers' published numbers (their tables), for the `pfedkit reproduce` tables: mean ± std as printed.

Table 1/2: pFedLA paper (Ma et al., CVPR 2022), personalized test accuracy % averaged over clients, keyed by
(dataset, number of clients). Table 1's FedAvg row is not legible in the available copy; FedBN has no EMNIST/FMNIST
entries (those models have no BatchNorm). Table 3: HeurpFedLA's k against accuracy and communication (10 clients).
pFedCS: the pFedCS paper gives only pFedCS's gains (accuracy points, final round) over each baseline, for the
global model (GM) and the personalized model (PM).
"""
from __future__ import annotations

TABLE1 = {
    'local': {('emnist', 10): '89.01±0.47', ('emnist', 100): '91.25±0.18', ('fmnist', 10): '85.83±0.17', ('fmnist', 100): '89.27±0.21', ('cifar10', 10): '59.44±0.40', ('cifar10', 100): '64.19±0.19', ('cifar100', 10): '41.68±0.89', ('cifar100', 100): '42.53±0.44'},
    'perfedavg': {('emnist', 10): '92.58±0.28', ('emnist', 100): '92.38±1.14', ('fmnist', 10): '93.63±1.83', ('fmnist', 100): '92.35±1.55', ('cifar10', 10): '52.54±1.79', ('cifar10', 100): '59.54±0.39', ('cifar100', 10): '38.79±1.89', ('cifar100', 100): '43.72±0.25'},
    'pfedme': {('emnist', 10): '92.42±0.44', ('emnist', 100): '94.36±0.50', ('fmnist', 10): '90.43±0.86', ('fmnist', 100): '98.57±0.38', ('cifar10', 10): '53.73±3.74', ('cifar10', 100): '65.97±1.61', ('cifar100', 10): '42.29±3.67', ('cifar100', 100): '53.60±1.28'},
    'pfedhn': {('emnist', 10): '93.94±0.16', ('emnist', 100): '96.64±0.91', ('fmnist', 10): '94.83±0.33', ('fmnist', 100): '98.80±0.92', ('cifar10', 10): '46.98±1.91', ('cifar10', 100): '63.71±1.26', ('cifar100', 10): '39.67±0.52', ('cifar100', 100): '51.36±1.77'},
    'fedbn': {('cifar10', 10): '59.36±0.92', ('cifar10', 100): '70.88±0.36', ('cifar100', 10): '45.18±0.42', ('cifar100', 100): '56.16±0.38'},
    'fedrep': {('emnist', 10): '91.82±0.15', ('emnist', 100): '95.23±0.12', ('fmnist', 10): '93.17±0.26', ('fmnist', 100): '97.15±0.09', ('cifar10', 10): '58.01±0.56', ('cifar10', 100): '71.94±0.22', ('cifar100', 10): '44.33±0.63', ('cifar100', 100): '56.47±0.41'},
    'fedfomo': {('emnist', 10): '88.33±0.29', ('emnist', 100): '91.36±0.17', ('fmnist', 10): '86.17±0.34', ('fmnist', 100): '91.83±0.12', ('cifar10', 10): '59.37±0.71', ('cifar10', 100): '66.07±0.24', ('cifar100', 10): '41.89±0.78', ('cifar100', 100): '44.28±0.28'},
    'pfedla': {('emnist', 10): '90.65±0.41', ('emnist', 100): '96.34±1.35', ('fmnist', 10): '94.34±0.29', ('fmnist', 100): '98.87±0.66', ('cifar10', 10): '61.43±0.56', ('cifar10', 100): '73.15±0.83', ('cifar100', 10): '47.22±0.77', ('cifar100', 100): '56.62±0.81'},
    'heurpfedla': {('emnist', 10): '94.11±0.13', ('emnist', 100): '95.04±0.41', ('fmnist', 10): '95.47±0.47', ('fmnist', 100): '96.95±0.44', ('cifar10', 10): '60.02±0.74', ('cifar10', 100): '73.05±1.02', ('cifar100', 10): '46.47±0.83', ('cifar100', 100): '54.43±1.37'},
}
TABLE2 = {
    'local': {('emnist', 10): '80.72±0.43', ('emnist', 100): '79.09±0.12', ('fmnist', 10): '65.60±0.59', ('fmnist', 100): '65.97±0.28', ('cifar10', 10): '39.79±0.42', ('cifar10', 100): '45.15±0.29', ('cifar100', 10): '26.29±0.37', ('cifar100', 100): '27.87±0.28'},
    'fedavg': {('emnist', 10): '90.43±0.58', ('emnist', 100): '93.91±0.32', ('fmnist', 10): '89.09±0.57', ('fmnist', 100): '98.25±0.38', ('cifar10', 10): '44.89±0.21', ('cifar10', 100): '54.03±0.37', ('cifar100', 10): '32.24±0.74', ('cifar100', 100): '40.89±0.46'},
    'perfedavg': {('emnist', 10): '90.86±0.78', ('emnist', 100): '94.09±0.18', ('fmnist', 10): '90.78±1.12', ('fmnist', 100): '98.53±0.95', ('cifar10', 10): '44.48±0.82', ('cifar10', 100): '54.40±0.44', ('cifar100', 10): '30.86±1.11', ('cifar100', 100): '42.56±0.28'},
    'pfedme': {('emnist', 10): '89.13±0.58', ('emnist', 100): '93.87±0.40', ('fmnist', 10): '85.15±0.94', ('fmnist', 100): '97.87±0.19', ('cifar10', 10): '46.97±1.19', ('cifar10', 100): '58.23±1.07', ('cifar100', 10): '33.45±0.86', ('cifar100', 100): '44.35±0.96'},
    'pfedhn': {('emnist', 10): '91.37±0.41', ('emnist', 100): '94.48±0.51', ('fmnist', 10): '93.45±0.11', ('fmnist', 100): '98.83±0.82', ('cifar10', 10): '37.49±0.94', ('cifar10', 100): '49.90±1.66', ('cifar100', 10): '26.35±0.93', ('cifar100', 100): '40.27±0.82'},
    'fedbn': {('cifar10', 10): '49.79±0.33', ('cifar10', 100): '60.62±0.42', ('cifar100', 10): '34.94±0.50', ('cifar100', 100): '46.42±0.54'},
    'fedrep': {('emnist', 10): '86.81±0.29', ('emnist', 100): '90.32±0.08', ('fmnist', 10): '79.13±0.56', ('fmnist', 100): '92.04±0.23', ('cifar10', 10): '49.16±0.73', ('cifar10', 100): '60.36±0.57', ('cifar100', 10): '34.19±0.74', ('cifar100', 100): '43.51±0.34'},
    'fedfomo': {('emnist', 10): '80.14±0.42', ('emnist', 100): '82.61±0.11', ('fmnist', 10): '64.10±0.38', ('fmnist', 100): '67.91±0.29', ('cifar10', 10): '40.62±0.31', ('cifar10', 100): '47.08±0.49', ('cifar100', 10): '27.33±0.51', ('cifar100', 100): '29.63±0.24'},
    'pfedla': {('emnist', 10): '92.06±0.71', ('emnist', 100): '94.83±1.04', ('fmnist', 10): '93.89±0.91', ('fmnist', 100): '98.41±0.98', ('cifar10', 10): '49.93±0.96', ('cifar10', 100): '61.82±1.89', ('cifar100', 10): '35.02±0.83', ('cifar100', 100): '48.79±1.60'},
    'heurpfedla': {('emnist', 10): '91.98±0.36', ('emnist', 100): '93.31±0.77', ('fmnist', 10): '92.01±0.74', ('fmnist', 100): '98.66±0.80', ('cifar10', 10): '49.06±0.68', ('cifar10', 100): '60.62±1.73', ('cifar100', 10): '35.42±0.49', ('cifar100', 100): '48.72±1.75'},
}

TABLE3 = {  # (dataset, k): (accuracy %, communication MB)
    ("emnist", 0): (90.65, 491.08), ("emnist", 1): (94.11, 488.65), ("emnist", 2): (93.94, 312.52),
    ("cifar10", 0): (61.43, 693.98), ("cifar10", 1): (60.02, 418.97), ("cifar10", 2): (59.90, 382.25),
    ("cifar10", 3): (59.23, 379.82),
}

PFEDCS_GAINS = {  # (dataset, model): {baseline: (GM gain, PM gain or None)}
    ("mnist", "mlr"): {"fedavg": (0.50, None), "perfedavg": (0.80, 0.52), "fedprox": (0.70, None), "fedtc": (0.30, 0.12)},
    ("mnist", "dnn"): {"fedavg": (2.41, None), "perfedavg": (0.23, 0.60), "fedprox": (2.07, None), "fedtc": (0.11, 0.10)},
    ("synthetic", "mlr"): {"fedavg": (2.06, None), "perfedavg": (1.00, 3.70), "fedprox": (2.05, None),
                           "fedtc": (0.45, 1.85)},
    ("synthetic", "dnn"): {"fedavg": (5.31, None), "perfedavg": (3.03, 1.20), "fedprox": (5.73, None),
                           "fedtc": (0.79, 0.94)},
}
