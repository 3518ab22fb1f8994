package kubevirtsim

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// AnnotationNodeName on a VM template picks the node its VMI runs on.
const AnnotationNodeName = "kubevirtsim.io/node-name"

// faults are the run-time fault switches kept in memory (the others are
// written to the objects themselves).
type faults struct {
	mu         sync.Mutex
	deny       map[string]string
	notRunning map[string]bool
	stuck      map[string]bool
}

func (f *faults) init() {
	f.deny, f.notRunning, f.stuck = map[string]string{}, map[string]bool{}, map[string]bool{}
}

func (f *faults) deniedVolumes() map[string]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.deny)
}

func (f *faults) isNotRunning(key string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.notRunning[key]
}

func (f *faults) isPodStuck(key string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stuck[key]
}

// DenyVolume makes the Harvester-like VM validator (WebhookHarvester) deny
// every VM update that adds a volume with this name or claim name, with 422
// and message (default "the volume <claim> is already used by VM
// <namespace>/another-vm"). It applies to client patches and to the legacy
// controller's spec updates alike.
func (s *Sim) DenyVolume(volume, message string) {
	s.faults.mu.Lock()
	s.faults.deny[volume] = message
	s.faults.mu.Unlock()
}

// AllowVolume lifts DenyVolume.
func (s *Sim) AllowVolume(volume string) {
	s.faults.mu.Lock()
	delete(s.faults.deny, volume)
	s.faults.mu.Unlock()
	if s.vmInf == nil {
		return
	}
	for _, k := range s.vmInf.GetStore().ListKeys() {
		s.vmQueue.Add(k) // retry now rather than after the backoff
	}
}

// SetVMINotRunning takes the VM's VMI out of phase Running (to Scheduled,
// with its hotplug machine frozen) or back, and waits until the cache shows
// it. Subresource calls then get 409 "VMI is not running" and legacy requests
// wait.
func (s *Sim) SetVMINotRunning(ctx context.Context, namespace, vm string, notRunning bool) error {
	key := namespace + "/" + vm
	s.faults.mu.Lock()
	s.faults.notRunning[key] = notRunning
	s.faults.mu.Unlock()
	s.vmiQueue.Add(key)
	return s.Wait(ctx, namespace, vm, func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi != nil && (vmi.Status.Phase == kubevirtv1.Running) != notRunning
	})
}

// SetAttachmentPodsStuck keeps the VM's attachment pods Pending (stuck) or
// lets them start.
func (s *Sim) SetAttachmentPodsStuck(namespace, vm string, stuck bool) {
	key := namespace + "/" + vm
	s.faults.mu.Lock()
	s.faults.stuck[key] = stuck
	s.faults.mu.Unlock()
	if !stuck {
		pods, _ := s.podLister.Pods(namespace).List(labels.SelectorFromSet(labels.Set{LabelAttachmentPodVMI: vm}))
		for _, p := range pods {
			s.podQueue.Add(p.Namespace + "/" + p.Name)
		}
	}
}

// SetSnapshotInProgress writes vm.status.snapshotInProgress (empty clears
// it); while set, the VM validator denies volume changes with "Cannot update
// vm disks or volumes until snapshot "<s>" completes".
func (s *Sim) SetSnapshotInProgress(ctx context.Context, namespace, vm, snapshot string) error {
	err := retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		cur := &kubevirtv1.VirtualMachine{}
		if err := s.kv.get(ctx, resVMs, namespace, vm, cur); err != nil {
			return err
		}
		if snapshot == "" {
			cur.Status.SnapshotInProgress = nil
		} else {
			cur.Status.SnapshotInProgress = ptr.To(snapshot)
		}
		return s.kv.update(ctx, resVMs, namespace, vm, "status", cur, &kubevirtv1.VirtualMachine{})
	})
	if err != nil {
		return err
	}
	return s.Wait(ctx, namespace, vm, func(v *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && ptr.Deref(v.Status.SnapshotInProgress, "") == snapshot
	})
}

// SetMigrationInProgress starts (or ends) a simulated live migration in the
// VMI's status; while it runs the status validator denies volume requests.
func (s *Sim) SetMigrationInProgress(ctx context.Context, namespace, vm string, on bool) error {
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		cur := &kubevirtv1.VirtualMachineInstance{}
		if err := s.kv.get(ctx, resVMIs, namespace, vm, cur); err != nil {
			return err
		}
		now := metav1.NewTime(time.Now().Add(-time.Second))
		if on {
			cur.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{
				StartTimestamp: &now, SourceNode: cur.Status.NodeName, TargetNode: cur.Status.NodeName + "-target",
			}
		} else if cur.Status.MigrationState != nil {
			cur.Status.MigrationState.EndTimestamp = &now
			cur.Status.MigrationState.Completed = true
		}
		return s.kv.update(ctx, resVMIs, namespace, vm, "status", cur, &kubevirtv1.VirtualMachineInstance{})
	})
}

// VMSpec describes a VM for CreateVM.
type VMSpec struct {
	Namespace, Name string
	// Stopped creates the VM halted (no VMI).
	Stopped bool
	// NodeName overrides Options.NodeName for this VM's VMI.
	NodeName string
	// Volumes and Disks are added to the template after the root disk
	// (a virtio containerDisk named "rootdisk"). Hotpluggable volumes go
	// through the attachment pod at start (§7 item 17).
	Volumes []kubevirtv1.Volume
	Disks   []kubevirtv1.Disk
	Labels  map[string]string
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
		tmplAnn[AnnotationNodeName] = spec.NodeName
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
					Networks: []kubevirtv1.Network{{Name: "default", NetworkSource: kubevirtv1.NetworkSource{Pod: &kubevirtv1.PodNetwork{}}}},
					Volumes: append([]kubevirtv1.Volume{{
						Name:         "rootdisk",
						VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "kubevirt/fedora-cloud-container-disk-demo"}},
					}}, spec.Volumes...),
				},
			},
		},
	}
	out := &kubevirtv1.VirtualMachine{}
	if err := s.kv.create(ctx, resVMs, spec.Namespace, vm, out); err != nil {
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
	cur, _ := s.cachedVM(spec.Namespace + "/" + spec.Name)
	return cur.DeepCopy(), nil
}

func (s *Sim) setRunStrategy(ctx context.Context, namespace, name string, rs kubevirtv1.VirtualMachineRunStrategy) error {
	patch := fmt.Sprintf(`{"spec":{"running":null,"runStrategy":%q}}`, rs)
	return s.kv.patch(ctx, resVMs, namespace, name, "", types.MergePatchType, []byte(patch), nil, &kubevirtv1.VirtualMachine{})
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

// StopVM sets runStrategy Halted. The VMI is deleted and lingers for
// Timings.VMIShutdown; StopVM does not wait for it (use Wait).
func (s *Sim) StopVM(ctx context.Context, namespace, name string) error {
	return s.setRunStrategy(ctx, namespace, name, kubevirtv1.RunStrategyHalted)
}

// DeleteVM deletes the VM. Its VMI outlives it for Timings.VMIShutdown.
func (s *Sim) DeleteVM(ctx context.Context, namespace, name string) error {
	err := s.kv.delete(ctx, resVMs, namespace, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// VM returns the cached VM and VMI (either may be nil).
func (s *Sim) VM(namespace, name string) (*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) {
	key := namespace + "/" + name
	var vm *kubevirtv1.VirtualMachine
	var vmi *kubevirtv1.VirtualMachineInstance
	if v, ok := s.cachedVM(key); ok {
		vm = v.DeepCopy()
	}
	if v, ok := s.cachedVMI(key); ok {
		vmi = v.DeepCopy()
	}
	return vm, vmi
}

// Wait blocks until cond holds for the cached VM and VMI (either may be
// nil), re-checking on every VM, VMI, PVC and KubeVirt event.
func (s *Sim) Wait(ctx context.Context, namespace, name string, cond func(*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) bool) error {
	for {
		ch := s.changed.wait()
		vm, vmi := s.VM(namespace, name)
		if cond(vm, vmi) {
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
		if v == nil || v.Spec.Template == nil || !hasVolume(v.Spec.Template.Spec.Volumes, volume) {
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
		if v != nil && v.Spec.Template != nil && hasVolume(v.Spec.Template.Spec.Volumes, volume) {
			return false
		}
		if vmi == nil {
			return true
		}
		_, inStatus := FindVolumeStatus(vmi, volume)
		return !hasVolume(vmi.Spec.Volumes, volume) && !inStatus
	})
}

func hasVolume(vols []kubevirtv1.Volume, name string) bool {
	for _, v := range vols {
		if v.Name == name {
			return true
		}
	}
	return false
}

// CreatePVC creates a host PVC of the provisioner's class (Block, RWX, like
// the driver's) and, unless noWait, waits until it is Bound.
func (s *Sim) CreatePVC(ctx context.Context, namespace, name, size string, noWait bool) (*corev1.PersistentVolumeClaim, error) {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:       ptr.To(corev1.PersistentVolumeBlock),
			StorageClassName: ptr.To(s.opts.StorageClass),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
		},
	}
	out, err := s.kube.CoreV1().PersistentVolumeClaims(namespace).Create(ctx, pvc, metav1.CreateOptions{})
	if err != nil || noWait {
		return out, err
	}
	for {
		ch := s.changed.wait()
		if cur, err := s.pvcLister.PersistentVolumeClaims(namespace).Get(name); err == nil && cur.Status.Phase == corev1.ClaimBound {
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
