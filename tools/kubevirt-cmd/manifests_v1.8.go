package main

import (
	"k8s.io/apimachinery/pkg/runtime"

	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/rbac"
)

// What the operator's generators are in KubeVirt v1.8 (the
// tools/kubevirt-v1.8.2 and -v1.8.4 modules link this file).

// controllerRBAC is virt-controller's RBAC. The network-attachment rules
// are included unless the ExternalNetResourceInjection gate is on, which
// Harvester does not set (install/strategy.go passes its negation).
func controllerRBAC() []runtime.Object { return rbac.GetAllController(namespace, true) }

// lineCRDs are the CRDs v1.8 adds: the VM backups and their trackers.
func lineCRDs() []crdGenerator {
	return []crdGenerator{components.NewVirtualMachineBackupCrd, components.NewVirtualMachineBackupTrackerCrd}
}
