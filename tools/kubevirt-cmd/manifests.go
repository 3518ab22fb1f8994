// Command kubevirt-manifests writes, as one multi-document YAML stream on
// stdout, the objects KubeVirt's operator would install that virt-controller
// and virt-api need: the CRDs (KubeVirt's included), the RBAC of the cluster,
// virt-api, virt-controller and virt-handler, virt-api's webhook
// configurations and its APIServices. It calls the operator's own generators
// so the manifests match the version the module that builds it pins.
//
// This file is the one source of every tools/kubevirt-v*/ module's
// generator: each module's cmd/kubevirt-manifests links to it (main.go) and
// to the manifests_v*.go of its KubeVirt line (variant.go), which holds what
// the operator's generators changed between lines (controllerRBAC,
// lineCRDs).
package main

import (
	"fmt"
	"os"

	extv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"

	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/rbac"
)

// namespace is where KubeVirt installs its components; the RBAC bindings and
// webhook services name it.
const namespace = "kubevirt"

func main() {
	if err := write(); err != nil {
		fmt.Fprintln(os.Stderr, "kubevirt-manifests:", err)
		os.Exit(1)
	}
}

func write() error {
	objs, err := crds()
	if err != nil {
		return err
	}
	objs = append(objs, rbac.GetAllCluster()...)
	objs = append(objs, rbac.GetAllApiServer(namespace)...)
	objs = append(objs, controllerRBAC()...)
	objs = append(objs, rbac.GetAllHandler(namespace)...)
	objs = append(objs,
		components.NewVirtAPIValidatingWebhookConfiguration(namespace),
		components.NewVirtAPIMutatingWebhookConfiguration(namespace))
	for _, s := range components.NewVirtAPIAPIServices(namespace) {
		objs = append(objs, s)
	}
	for _, o := range objs {
		b, err := yaml.Marshal(o)
		if err != nil {
			return err
		}
		if _, err := fmt.Printf("---\n%s", b); err != nil {
			return err
		}
	}
	return nil
}

// crdGenerator is one of the operator's CRD generators.
type crdGenerator func() (*extv1.CustomResourceDefinition, error)

// crds lists the same CRDs as the operator's install strategy, plus the
// KubeVirt CRD the operator's own deployment carries.
func crds() ([]runtime.Object, error) {
	gens := []crdGenerator{
		components.NewKubeVirtCrd,
		components.NewVirtualMachineInstanceCrd, components.NewPresetCrd, components.NewReplicaSetCrd,
		components.NewVirtualMachineCrd, components.NewVirtualMachineInstanceMigrationCrd,
		components.NewVirtualMachineSnapshotCrd, components.NewVirtualMachineSnapshotContentCrd,
		components.NewVirtualMachineRestoreCrd, components.NewVirtualMachineInstancetypeCrd,
		components.NewVirtualMachineClusterInstancetypeCrd, components.NewVirtualMachinePoolCrd,
		components.NewMigrationPolicyCrd, components.NewVirtualMachinePreferenceCrd,
		components.NewVirtualMachineClusterPreferenceCrd, components.NewVirtualMachineExportCrd,
		components.NewVirtualMachineCloneCrd,
	}
	gens = append(gens, lineCRDs()...)
	var out []runtime.Object
	for _, g := range gens {
		crd, err := g()
		if err != nil {
			return nil, err
		}
		out = append(out, crd)
	}
	return out, nil
}
