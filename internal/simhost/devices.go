package simhost

import (
	"context"
	"sync"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// vanishSwitch turns virt-handler's vanished-device fault of a VM's volume
// (named as the VMI names it) on or off and wakes virt-handler for the VM.
type vanishSwitch func(namespace, vm, volume string, on bool)

// longhornDevices carries the Longhorn stand-in's device losses
// (simlonghorn.DeviceHook) to virt-handler: while a Longhorn volume is
// faulted, and until Longhorn attaches it again on the host node, every VM
// whose pods on that node held the volume's claim has that volume's device
// vanished (virthandler.Faults.SetDeviceVanished), as on a Harvester host,
// where the disk plugged from a stopped engine's device fails the guest's
// I/O and pauses the domain.
type longhornDevices struct {
	kube kubernetes.Interface

	mu sync.Mutex
	// set is nil until the KubeVirt side runs: the simulator starts after
	// Longhorn, whose first claim it needs.
	set vanishSwitch
	// gone are the vanished devices, by Longhorn volume.
	gone map[string][]vanished
}

// vanished is one VM volume whose device a Longhorn volume's fault took.
type vanished struct {
	node, namespace, vm, volume string
	pod                         types.UID // the pod that held it
	podName                     string
}

func newLonghornDevices(kube kubernetes.Interface) *longhornDevices {
	return &longhornDevices{kube: kube, gone: map[string][]vanished{}}
}

// use sets where the faults go once the KubeVirt side runs.
func (d *longhornDevices) use(set vanishSwitch) {
	d.mu.Lock()
	d.set = set
	d.mu.Unlock()
}

// DeviceGone vanishes the device of each VM volume that a pod on node held.
func (d *longhornDevices) DeviceGone(ctx context.Context, volume, node string, holders []simlonghorn.Holder) {
	log := klog.FromContext(ctx).WithValues("longhornVolume", volume, "node", node)
	for _, h := range holders {
		vm, err := d.vmOf(ctx, h.Pod)
		if err != nil || vm == "" {
			// A pod of no VM (or one whose owner is gone) feeds no disk.
			log.V(2).Info("Longhorn device gone under a pod of no running VM", "pod", klog.KObj(h.Pod), "err", err)
			continue
		}
		v := vanished{node: node, namespace: h.Pod.Namespace, vm: vm, volume: h.Volume, pod: h.Pod.UID, podName: h.Pod.Name}
		if d.record(volume, v) {
			log.Info("Longhorn volume faulted under a running pod: its device vanished", "vm", v.namespace+"/"+vm, "volume", v.volume, "pod", klog.KObj(h.Pod))
		}
		d.flip(ctx, v, true)
	}
}

// DeviceBack clears the vanished devices of the volume on node, and those
// on other nodes whose pod is gone: no pod there is left to be without it,
// and a new one starts only once Longhorn attached the volume for it.
func (d *longhornDevices) DeviceBack(ctx context.Context, volume, node string) {
	d.mu.Lock()
	cands := append([]vanished(nil), d.gone[volume]...)
	d.mu.Unlock()
	for _, v := range cands {
		if v.node != node && d.podExists(ctx, v) {
			continue
		}
		d.forget(volume, v)
		klog.FromContext(ctx).Info("Longhorn volume attached again: its device is back", "longhornVolume", volume, "node", node,
			"vm", v.namespace+"/"+v.vm, "volume", v.volume)
		d.flip(ctx, v, false)
	}
}

// record adds v to the volume's vanished devices and reports whether it is
// new there (a fault may be told again).
func (d *longhornDevices) record(volume string, v vanished) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, o := range d.gone[volume] {
		if o == v {
			return false
		}
	}
	d.gone[volume] = append(d.gone[volume], v)
	return true
}

func (d *longhornDevices) forget(volume string, v vanished) {
	d.mu.Lock()
	defer d.mu.Unlock()
	list := d.gone[volume][:0]
	for _, o := range d.gone[volume] {
		if o != v {
			list = append(list, o)
		}
	}
	if len(list) == 0 {
		delete(d.gone, volume)
		return
	}
	d.gone[volume] = list
}

// flip sets the fault, unless another faulted Longhorn volume still holds
// the same VM volume's device away (one claim per VMI volume, so only a
// pod on another node of the same VM can).
func (d *longhornDevices) flip(ctx context.Context, v vanished, on bool) {
	d.mu.Lock()
	set := d.set
	if !on {
		for _, list := range d.gone {
			for _, o := range list {
				if o.namespace == v.namespace && o.vm == v.vm && o.volume == v.volume {
					on = true
				}
			}
		}
	}
	d.mu.Unlock()
	if set == nil {
		klog.FromContext(ctx).Info("Longhorn device change before KubeVirt runs: not passed on", "vm", v.namespace+"/"+v.vm, "volume", v.volume)
		return
	}
	set(v.namespace, v.vm, v.volume, on)
}

// vmOf is the VM whose pod this is: a virt-launcher pod's controller is
// the VMI, an attachment pod's its virt-launcher pod (kubevirt v1.7.0
// pkg/virt-controller/services/template.go:633-634 and :964-965), and a
// VMI is named as its VM. "" for a pod of no VMI.
func (d *longhornDevices) vmOf(ctx context.Context, pod *corev1.Pod) (string, error) {
	ref := metav1.GetControllerOf(pod)
	if ref != nil && ref.Kind == "Pod" {
		launcher, err := d.kube.CoreV1().Pods(pod.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
		if err != nil {
			return "", err
		}
		ref = metav1.GetControllerOf(launcher)
	}
	if ref == nil || ref.Kind != "VirtualMachineInstance" {
		return "", nil
	}
	return ref.Name, nil
}

func (d *longhornDevices) podExists(ctx context.Context, v vanished) bool {
	p, err := d.kube.CoreV1().Pods(v.namespace).Get(ctx, v.podName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false
	}
	// On another error keep the fault: clearing it early would be the
	// kinder model.
	return err != nil || p.UID == v.pod
}

// passDeviceLosses points Longhorn's device losses at the control plane
// that runs, once it runs: the simulator's faults wake its virt-handler,
// the real control plane's node agents need the VMI queued.
func (h *Host) passDeviceLosses() {
	if h.nodes == nil || h.nodes.devices == nil {
		return
	}
	if h.Sim != nil {
		sim := h.Sim
		h.nodes.devices.use(func(ns, vm, volume string, on bool) { sim.Faults().SetDeviceVanished(ns, vm, volume, on) })
		return
	}
	cp := h.Real
	if cp == nil {
		return
	}
	h.nodes.devices.use(func(ns, vm, volume string, on bool) {
		cp.Faults().SetDeviceVanished(ns+"/"+vm, volume, on)
		cp.Requeue(ns, vm)
	})
}
