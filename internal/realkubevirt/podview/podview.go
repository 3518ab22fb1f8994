// Package podview is what virt-handler sees of an attachment pod on its
// host node, one rule for the node agents of KubeVirt's real control plane
// (internal/realkubevirt) and for the simulator's virt-handler feed
// (internal/kubevirtsim) when real host kubelets run the pods. It is apart
// from internal/realkubevirt so that the simulator need not import
// KubeVirt's client.
package podview

import (
	"slices"

	corev1 "k8s.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/virthandler"
)

// HandlerPod is an attachment pod as virt-handler finds it on its node: its
// UID and the volumes whose devices are there, named as KubeVirt names the
// pod's claim volumes (after the VMI's volumes, v1.7.0
// pkg/virt-controller/services/template.go:1051-1052). virt-handler looks
// a device up in the pod's directory on the node (v1.7.0
// pkg/virt-handler/hotplug-disk/mount.go:448 getSourceMajorMinor), which
// holds it only once the host kubelet has published the volume; the
// kubelet starts a pod's containers only after every volume of the pod is
// attached and published (kubernetes v1.35.4 pkg/kubelet/kubelet.go:2120
// WaitForAttachAndMount), so a pod none of whose containers has started
// offers no device yet.
func HandlerPod(p *corev1.Pod) virthandler.Pod {
	if !DevicesPublished(p) {
		return virthandler.Pod{UID: p.UID}
	}
	return AllVolumes(p)
}

// AllVolumes is the pod with every claim volume it lists, for a kubelet
// stand-in that publishes a pod's volumes as it binds it.
func AllVolumes(p *corev1.Pod) virthandler.Pod {
	hp := virthandler.Pod{UID: p.UID}
	for _, v := range p.Spec.Volumes {
		if v.PersistentVolumeClaim != nil {
			hp.Volumes = append(hp.Volumes, v.Name)
		}
	}
	return hp
}

// DevicesPublished reports whether the host kubelet has published every
// volume of the pod: one of its containers has started.
func DevicesPublished(p *corev1.Pod) bool {
	return slices.ContainsFunc(p.Status.ContainerStatuses, func(c corev1.ContainerStatus) bool {
		return c.State.Running != nil || c.State.Terminated != nil
	})
}
