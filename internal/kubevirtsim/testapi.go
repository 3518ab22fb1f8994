package kubevirtsim

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// annotationNodeName on a VM template picks the node its VMI runs on.
const annotationNodeName = "kubevirtsim.io/node-name"

// VMSpec describes a VM for CreateVM.
type VMSpec struct {
	Namespace, Name string
	// Stopped creates the VM halted (no VMI).
	Stopped bool
	// NodeName overrides Options.NodeName for this VM's VMI.
	NodeName string
	// Volumes and Disks are added to the template after the root disk
	// (a virtio containerDisk named "rootdisk"). Hotpluggable volumes go
	// through the attachment pod at start.
	Volumes []kubevirtv1.Volume
	Disks   []kubevirtv1.Disk
	Labels  map[string]string
	// NodeSelector and Affinity go into the VMI template, for the scheduler
	// that places virt-launcher pods with Options.Kubelets.
	NodeSelector map[string]string
	Affinity     *corev1.Affinity
	// NoWait returns right after creation instead of waiting for the VMI to
	// run (or, when Stopped, for the VM's status).
	NoWait bool
}

// CreateVM creates a VM and, unless spec.Stopped, waits until its VMI is
// Running with a node and MAC addresses.
func (s *Sim) CreateVM(ctx context.Context, spec VMSpec) (*kubevirtv1.VirtualMachine, error) {
	strategy := kubevirtv1.RunStrategyAlways
	if spec.Stopped {
		strategy = kubevirtv1.RunStrategyHalted
	}
	tmplAnn := map[string]string{}
	if spec.NodeName != "" {
		tmplAnn[annotationNodeName] = spec.NodeName
	}
	vm := &kubevirtv1.VirtualMachine{
		TypeMeta:   metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachine"},
		ObjectMeta: metav1.ObjectMeta{Name: spec.Name, Namespace: spec.Namespace, Labels: spec.Labels},
		Spec: kubevirtv1.VirtualMachineSpec{
			RunStrategy: &strategy,
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"harvesterhci.io/vmName": spec.Name}, Annotations: tmplAnn},
				Spec: kubevirtv1.VirtualMachineInstanceSpec{
					Domain: kubevirtv1.DomainSpec{
						Resources: kubevirtv1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}},
						Devices: kubevirtv1.Devices{
							Disks: append([]kubevirtv1.Disk{{
								Name: "rootdisk", BootOrder: ptr.To[uint](1),
								DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}},
							}}, spec.Disks...),
							Interfaces: []kubevirtv1.Interface{{Name: "default", InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Masquerade: &kubevirtv1.InterfaceMasquerade{}}}},
						},
					},
					NodeSelector: spec.NodeSelector,
					Affinity:     spec.Affinity,
					Networks:     []kubevirtv1.Network{{Name: "default", NetworkSource: kubevirtv1.NetworkSource{Pod: &kubevirtv1.PodNetwork{}}}},
					Volumes: append([]kubevirtv1.Volume{{
						Name:         "rootdisk",
						VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "kubevirt/fedora-cloud-container-disk-demo"}},
					}}, spec.Volumes...),
				},
			},
		},
	}
	out := &kubevirtv1.VirtualMachine{}
	if err := s.c.kv.create(ctx, resVMs, spec.Namespace, vm, out); err != nil {
		return nil, err
	}
	if spec.NoWait {
		return out, nil
	}
	err := s.Wait(ctx, spec.Namespace, spec.Name, func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		if vm == nil || vm.Status.PrintableStatus == "" {
			return false
		}
		if spec.Stopped {
			return true
		}
		return vm.Status.Ready && vmi != nil && vmi.Status.Phase == kubevirtv1.Running
	})
	if err != nil {
		return nil, fmt.Errorf("VM %s/%s did not start: %w", spec.Namespace, spec.Name, err)
	}
	cur, _ := s.c.cachedVM(spec.Namespace + "/" + spec.Name)
	return cur.DeepCopy(), nil
}

func (s *Sim) setRunStrategy(ctx context.Context, namespace, name string, rs kubevirtv1.VirtualMachineRunStrategy) error {
	patch := fmt.Sprintf(`{"spec":{"running":null,"runStrategy":%q}}`, rs)
	return s.c.kv.patch(ctx, resVMs, namespace, name, "", types.MergePatchType, []byte(patch), nil, &kubevirtv1.VirtualMachine{})
}

// StartVM sets runStrategy Always and waits until the VMI runs.
func (s *Sim) StartVM(ctx context.Context, namespace, name string) error {
	if err := s.setRunStrategy(ctx, namespace, name, kubevirtv1.RunStrategyAlways); err != nil {
		return err
	}
	return s.Wait(ctx, namespace, name, func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vm != nil && vm.Status.Ready && vmi != nil && vmi.DeletionTimestamp == nil && vmi.Status.Phase == kubevirtv1.Running
	})
}

// StopVM sets runStrategy Halted. The VMI is deleted and lingers for its
// termination grace period (30 s unless the template sets one, times
// Options.Scale); StopVM does not wait for it (use Wait).
func (s *Sim) StopVM(ctx context.Context, namespace, name string) error {
	return s.setRunStrategy(ctx, namespace, name, kubevirtv1.RunStrategyHalted)
}

// DeleteVM deletes the VM. Its VMI outlives it for its termination grace
// period, as after StopVM.
func (s *Sim) DeleteVM(ctx context.Context, namespace, name string) error {
	err := s.c.kv.delete(ctx, resVMs, namespace, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// VM returns the cached VM and VMI (either may be nil).
func (s *Sim) VM(namespace, name string) (*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) {
	return s.c.snapshotVM(namespace, name)
}

// Wait blocks until cond holds for the cached VM and VMI (either may be
// nil), re-checking on every VM, VMI, PVC and KubeVirt event.
func (s *Sim) Wait(ctx context.Context, namespace, name string, cond func(*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) bool) error {
	return waitVM(ctx, s.c, namespace, name, cond)
}

// snapshotVM returns deep copies of the cached VM and VMI (either may be nil).
func (c *cluster) snapshotVM(namespace, name string) (*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) {
	key := namespace + "/" + name
	var vm *kubevirtv1.VirtualMachine
	var vmi *kubevirtv1.VirtualMachineInstance
	if v, ok := c.cachedVM(key); ok {
		vm = v.DeepCopy()
	}
	if v, ok := c.cachedVMI(key); ok {
		vmi = v.DeepCopy()
	}
	return vm, vmi
}

func waitVM(ctx context.Context, c *cluster, namespace, name string, cond func(*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) bool) error {
	for {
		ch := c.changed.wait()
		if cond(c.snapshotVM(namespace, name)) {
			return nil
		}
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-ch:
		case <-time.After(time.Second):
		}
	}
}

// FindVolumeStatus returns the volumeStatus entry of a volume.
func FindVolumeStatus(vmi *kubevirtv1.VirtualMachineInstance, volume string) (kubevirtv1.VolumeStatus, bool) {
	if vmi == nil {
		return kubevirtv1.VolumeStatus{}, false
	}
	for _, e := range vmi.Status.VolumeStatus {
		if e.Name == volume {
			return e, true
		}
	}
	return kubevirtv1.VolumeStatus{}, false
}

// WaitVolumeReady waits until volume is attached the way the driver judges
// it (in the VM spec, VMI entry with hotplugVolume, phase Ready and a target)
// and returns the target.
func (s *Sim) WaitVolumeReady(ctx context.Context, namespace, vm, volume string) (string, error) {
	var target string
	err := s.Wait(ctx, namespace, vm, func(v *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		if v == nil || v.Spec.Template == nil || !HasVolume(v.Spec.Template.Spec.Volumes, volume) {
			return false
		}
		e, ok := FindVolumeStatus(vmi, volume)
		if ok && e.HotplugVolume != nil && e.Phase == kubevirtv1.VolumeReady && e.Target != "" {
			target = e.Target
			return true
		}
		return false
	})
	return target, err
}

// WaitVolumeDetached waits until volume is gone from the VM spec, the VMI
// spec and the VMI volumeStatus (a missing VM or VMI counts as detached).
func (s *Sim) WaitVolumeDetached(ctx context.Context, namespace, vm, volume string) error {
	return s.Wait(ctx, namespace, vm, func(v *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		if v != nil && v.Spec.Template != nil && HasVolume(v.Spec.Template.Spec.Volumes, volume) {
			return false
		}
		if vmi == nil {
			return true
		}
		_, inStatus := FindVolumeStatus(vmi, volume)
		return !HasVolume(vmi.Spec.Volumes, volume) && !inStatus
	})
}

// HasVolume reports whether a VM template or VMI spec lists the volume.
func HasVolume(vols []kubevirtv1.Volume, name string) bool {
	return slices.ContainsFunc(vols, func(v kubevirtv1.Volume) bool { return v.Name == name })
}

// CreatePVC creates a host PVC of the provisioner's class (Block, RWX, like
// the driver's) and, unless noWait, waits until it is Bound.
func (s *Sim) CreatePVC(ctx context.Context, namespace, name, size string, noWait bool) (*corev1.PersistentVolumeClaim, error) {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:       ptr.To(corev1.PersistentVolumeBlock),
			StorageClassName: ptr.To(s.c.opts.StorageClass),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
		},
	}
	out, err := s.c.kube.CoreV1().PersistentVolumeClaims(namespace).Create(ctx, pvc, metav1.CreateOptions{})
	if err != nil || noWait {
		return out, err
	}
	for {
		ch := s.c.changed.wait()
		if cur, err := s.c.pvcLister.PersistentVolumeClaims(namespace).Get(name); err == nil && cur.Status.Phase == corev1.ClaimBound {
			return cur.DeepCopy(), nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("PVC %s/%s not bound: %w", namespace, name, context.Cause(ctx))
		case <-ch:
		case <-time.After(time.Second):
		}
	}
}
