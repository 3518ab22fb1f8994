package simlonghorn

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// DeviceHook hears of a volume's block device leaving the host nodes its
// engines ran on, and of it coming back. A faulted volume's engine is
// stopped (longhorn-manager v1.10.1 controller/volume_attachment_controller.go:568
// shouldDoDetach detaches a faulted volume whatever its tickets, and
// controller/volume_controller.go:2017-2018 closeVolumeDependentResources
// sets the engine's desired state to stopped), and with it the frontend
// that backs /dev/longhorn/<volume>: the pods that use the volume's claim
// on those nodes keep running, over a device that is gone, until Longhorn
// attaches the volume there again. The simulated host (internal/simhost)
// passes this on to virt-handler, where the plugged disk pauses its domain.
//
// Calls come from the stand-in's reconcile loop after the status change was
// written, one at a time; a change may be told again (a later pass that
// redoes it), so an implementation must take repeats.
type DeviceHook interface {
	// DeviceGone: the volume faulted while an engine of it ran on node;
	// holders are the claim volumes of the pods on node that use it.
	DeviceGone(ctx context.Context, volume, node string, holders []Holder)
	// DeviceBack: the volume is attached on node again.
	DeviceBack(ctx context.Context, volume, node string)
}

// Holder is a pod and the name of its pod volume that holds a Longhorn
// volume's claim.
type Holder struct {
	Pod    *corev1.Pod
	Volume string
}

// tellDevices tells Options.Devices what the pass just written did to the
// volume's devices: a fault takes them from every node an engine ran on,
// an engine that becomes available on a node brings it back there.
func (s *Sim) tellDevices(ctx context.Context, p *pass, old, cur *Volume) {
	hook := s.opts.Devices
	if hook == nil {
		return
	}
	if cur.Status.Robustness == VolumeRobustnessFaulted {
		if old.Status.Robustness == VolumeRobustnessFaulted {
			return
		}
		for _, node := range engineNodes(old) {
			holders, err := holdersOn(p, cur, node)
			if err != nil {
				klog.FromContext(ctx).Error(err, "Longhorn volume faulted: cannot list the pods that hold it", "volume", cur.Name, "node", node)
			}
			hook.DeviceGone(ctx, cur.Name, node, holders)
		}
		return
	}
	for _, node := range engineNodes(cur) {
		if availableOn(cur, node) && !availableOn(old, node) {
			hook.DeviceBack(ctx, cur.Name, node)
		}
	}
}

// engineNodes are the nodes an engine of the volume runs on: the volume's
// and the migration's.
func engineNodes(v *Volume) []string {
	var out []string
	for _, n := range []string{v.Status.CurrentNodeID, v.Status.CurrentMigrationNodeID} {
		if n != "" {
			out = append(out, n)
		}
	}
	return out
}

// holdersOn are the pods on node that use the volume's claim, each with
// the pod volume that holds it.
func holdersOn(p *pass, v *Volume, node string) ([]Holder, error) {
	ks := v.Status.KubernetesStatus
	if ks.PVCName == "" {
		return nil, nil
	}
	pods, err := p.podsOf(ks.Namespace)
	if err != nil {
		return nil, err
	}
	var out []Holder
	for i := range pods {
		pod := &pods[i]
		if pod.Spec.NodeName != node {
			continue
		}
		for _, vol := range pod.Spec.Volumes {
			if vol.PersistentVolumeClaim != nil && vol.PersistentVolumeClaim.ClaimName == ks.PVCName {
				out = append(out, Holder{Pod: pod.DeepCopy(), Volume: vol.Name})
			}
		}
	}
	return out, nil
}
