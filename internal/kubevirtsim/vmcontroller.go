package kubevirtsim

import (
	"context"
	"fmt"
	"maps"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Condition reasons written by the VM controller.
const (
	ReasonHotPlugVolumeError = "HotPlugVolumeError"
	ReasonFailedUpdateError  = "FailedUpdateError"
)

const vmiFinalizer = "kubevirt.io/virtualMachineControllerFinalize"

// syncError is a failed pass with the reason of the VM's Failure condition
// (v1.7.0 pkg/virt-controller/watch/vm/vm.go:2767 processFailureCondition).
type syncError struct {
	reason string
	err    error
}

func (e *syncError) Error() string { return e.err.Error() }

// vmController is virt-controller's VM controller: start and stop, the
// legacy volumeRequests processing, the declarative hotplug controller and
// the VM status. It keeps no state of its own beyond its queue (whose
// per-VM backoff is KubeVirt's).
type vmController struct {
	c     *cluster
	api   *virtAPI // the VMI subresources the legacy path calls
	queue workQueue
	// beforeDeclarativePatch, when set, runs between reading the VMI and
	// patching it: a test seam to move the VMI on inside that window.
	beforeDeclarativePatch atomic.Pointer[func(*kubevirtv1.VirtualMachineInstance)]
}

func newVMController(c *cluster, api *virtAPI) *vmController {
	return &vmController{c: c, api: api, queue: newWorkQueue("vm", c.t.BackoffBase, c.t.BackoffMax)}
}

func (v *vmController) register() {
	enqueue := func(obj any) { v.queue.AddAfter(objectKey(obj), v.c.jit.d(v.c.t.VMReconcile)) }
	_, _ = v.c.vmInf.AddEventHandler(onEvent(enqueue))
	_, _ = v.c.vmiInf.AddEventHandler(onEvent(enqueue)) // VMI name == VM name
}

func (v *vmController) run(ctx context.Context) { v.queue.run(ctx, v.c, 3, v.sync) }
func (v *vmController) shutdown()               { v.queue.ShutDown() }

// enqueueAll retries every VM now rather than after its backoff.
func (v *vmController) enqueueAll() {
	for _, k := range v.c.vmInf.GetStore().ListKeys() {
		v.queue.Add(k)
	}
}

func vmRunning(vm *kubevirtv1.VirtualMachine) bool {
	if vm.Spec.RunStrategy != nil {
		return *vm.Spec.RunStrategy != kubevirtv1.RunStrategyHalted
	}
	return vm.Spec.Running != nil && *vm.Spec.Running
}

// sync is one pass of the VM controller over one VM.
func (v *vmController) sync(ctx context.Context, key string) (time.Duration, error) {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	log := v.c.log.WithValues("vm", key)
	cached, exists := v.c.cachedVM(key)
	vmi, vmiExists := v.c.cachedVMI(key)

	if !exists || cached.DeletionTimestamp != nil {
		// The VM is gone: its VMI shuts down (and outlives it for a while).
		if vmiExists && vmi.DeletionTimestamp == nil && (!exists || isControlledBy(vmi, cached.UID)) {
			log.V(2).Info("VM gone, deleting its VMI")
			if err := v.c.kv.delete(ctx, resVMIs, ns, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: ptr.To(vmi.UID)}}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
				return 0, err
			}
		}
		return 0, nil
	}
	vm := cached.DeepCopy()
	if vmiExists && !isControlledBy(vmi, vm.UID) {
		vmiExists, vmi = false, nil // someone else's VMI: leave it alone
	}

	// Start and stop.
	switch running := vmRunning(vm); {
	case running && !vmiExists:
		if err := v.createVMI(ctx, vm); err != nil {
			return 0, err
		}
	case !running && vmiExists && vmi.DeletionTimestamp == nil:
		log.V(2).Info("stopping VM, deleting its VMI")
		if err := v.c.kv.delete(ctx, resVMIs, ns, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return 0, err
		}
	}

	legacy, declarative := v.c.gates()
	stored := cached // the VM as the API server has it
	var syncErr *syncError
	switch {
	case legacy && len(vm.Status.VolumeRequests) > 0:
		spec := vm.Spec.Template.Spec.DeepCopy()
		if err := v.handleVolumeRequests(ctx, vm, spec, vmi); err != nil {
			syncErr = &syncError{ReasonHotPlugVolumeError, fmt.Errorf("Error encountered while handling volume hotplug requests: %v", err)}
			break
		}
		if !equality.Semantic.DeepEqual(spec, &vm.Spec.Template.Spec) {
			upd := vm.DeepCopy()
			upd.Spec.Template.Spec = *spec
			out := &kubevirtv1.VirtualMachine{}
			if err := v.c.kv.update(ctx, resVMs, ns, name, "", upd, out); err != nil {
				log.V(2).Info("VM spec update failed", "err", err)
				// Same text in every simulated tag (v1.7.0 vm.go:3254).
				syncErr = &syncError{ReasonFailedUpdateError, fmt.Errorf("Error encountered when trying to update vm according to add volume and/or memory dump requests: %v", err)}
				break
			}
			log.V(2).Info("VM spec updated from volume requests")
			stored = out
		}
	case declarative:
		syncErr = v.handleDeclarative(ctx, vm, vmi)
	}

	if err := v.updateStatus(ctx, stored, vmi, legacy, syncErr); err != nil {
		return 0, err
	}
	if syncErr != nil {
		return 0, syncErr
	}
	return 0, nil
}

func isControlledBy(vmi *kubevirtv1.VirtualMachineInstance, uid types.UID) bool {
	for _, o := range vmi.OwnerReferences {
		if o.Controller != nil && *o.Controller && o.UID == uid {
			return true
		}
	}
	return false
}

// handleVolumeRequests applies every queued request to spec in order and
// calls the VMI subresource where the live VMI needs it; the first error
// aborts the pass.
func (v *vmController) handleVolumeRequests(ctx context.Context, vm *kubevirtv1.VirtualMachine, spec *kubevirtv1.VirtualMachineInstanceSpec, vmi *kubevirtv1.VirtualMachineInstance) error {
	vmiVols := map[string]bool{}
	if vmi != nil {
		for _, v := range vmi.Spec.Volumes {
			vmiVols[v.Name] = true
		}
	}
	for i := range vm.Status.VolumeRequests {
		req := &vm.Status.VolumeRequests[i]
		applyVolumeRequest(spec, req)
		if vmi == nil || vmi.DeletionTimestamp != nil {
			continue
		}
		switch {
		case req.AddVolumeOptions != nil && !vmiVols[req.AddVolumeOptions.Name],
			req.RemoveVolumeOptions != nil && vmiVols[req.RemoveVolumeOptions.Name]:
			// Through virt-api, as the controller's client calls it: the
			// call spends virt-api's budget and may time out while virt-api
			// still carries it out.
			serr := v.api.do(ctx, func(ctx context.Context) *apierrors.StatusError {
				sleepCtx(ctx, v.c.jit.d(v.c.t.API))
				return v.api.vmiVolumePatch(ctx, vmi.Namespace, vmi.Name, req, true)
			})
			if serr != nil {
				return serr
			}
			v.c.log.V(2).Info("VMI patched from volume request", "vm", vm.Namespace+"/"+vm.Name, "volume", requestName(req))
		}
	}
	return nil
}

// trimDoneVolumeRequests drops an add once its volume and disk are in the
// template spec and a remove once neither is.
func trimDoneVolumeRequests(reqs []kubevirtv1.VirtualMachineVolumeRequest, spec *kubevirtv1.VirtualMachineInstanceSpec) []kubevirtv1.VirtualMachineVolumeRequest {
	vols, disks := map[string]bool{}, map[string]bool{}
	for _, v := range spec.Volumes {
		vols[v.Name] = true
	}
	for _, d := range spec.Domain.Devices.Disks {
		disks[d.Name] = true
	}
	var out []kubevirtv1.VirtualMachineVolumeRequest
	for _, r := range reqs {
		switch {
		case r.AddVolumeOptions != nil && vols[r.AddVolumeOptions.Name] && disks[r.AddVolumeOptions.Name]:
		case r.RemoveVolumeOptions != nil && !vols[r.RemoveVolumeOptions.Name] && !disks[r.RemoveVolumeOptions.Name]:
		default:
			out = append(out, r)
		}
	}
	return out
}

func (v *vmController) updateStatus(ctx context.Context, vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, legacy bool, syncErr *syncError) error {
	st := vm.Status.DeepCopy()
	if legacy && len(st.VolumeRequests) > 0 {
		st.VolumeRequests = trimDoneVolumeRequests(st.VolumeRequests, &vm.Spec.Template.Spec)
	}
	running := vmi != nil && vmi.DeletionTimestamp == nil && vmi.Status.Phase == kubevirtv1.Running
	st.Created = vmi != nil
	st.Ready = running
	switch {
	case vmi == nil && vmRunning(vm):
		st.PrintableStatus = kubevirtv1.VirtualMachineStatusStarting
	case vmi == nil:
		st.PrintableStatus = kubevirtv1.VirtualMachineStatusStopped
	case vmi.DeletionTimestamp != nil:
		st.PrintableStatus = kubevirtv1.VirtualMachineStatusStopping
	case running:
		st.PrintableStatus = kubevirtv1.VirtualMachineStatusRunning
	default:
		st.PrintableStatus = kubevirtv1.VirtualMachineStatusStarting
	}
	st.DesiredGeneration = vm.Generation
	st.ObservedGeneration = vm.Generation
	if vm.Spec.RunStrategy != nil {
		st.RunStrategy = *vm.Spec.RunStrategy
	}
	setFailure(st, syncErr)
	if equality.Semantic.DeepEqual(st, &vm.Status) {
		return nil
	}
	upd := vm.DeepCopy()
	upd.Status = *st
	if err := v.c.kv.update(ctx, resVMs, vm.Namespace, vm.Name, "status", upd, &kubevirtv1.VirtualMachine{}); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		v.c.log.V(3).Info("VM status update failed", "vm", vm.Namespace+"/"+vm.Name, "err", err)
		return err
	}
	return nil
}

func setFailure(st *kubevirtv1.VirtualMachineStatus, syncErr *syncError) {
	var conds []kubevirtv1.VirtualMachineCondition
	var old *kubevirtv1.VirtualMachineCondition
	for i, c := range st.Conditions {
		if c.Type == kubevirtv1.VirtualMachineFailure {
			old = &st.Conditions[i]
			continue
		}
		conds = append(conds, c)
	}
	if syncErr != nil {
		c := kubevirtv1.VirtualMachineCondition{
			Type: kubevirtv1.VirtualMachineFailure, Status: "True",
			Reason: syncErr.reason, Message: syncErr.err.Error(),
			LastTransitionTime: metav1.Now(),
		}
		if old != nil && old.Reason == c.Reason && old.Message == c.Message {
			c = *old
		}
		conds = append(conds, c)
	}
	st.Conditions = conds
}

// handleDeclarative is the declarative hotplug controller (v1.7.0
// pkg/storage/hotplug/hotplug.go, the same in every tag that has it): while
// the VMI is Running, one compare-and-swap JSON patch of the VMI's volumes
// and disks removes hotplug volumes missing from the VM spec or changed
// there (a changed disk alone does not count) and adds VM hotplug volumes
// the VMI lacks and has no volumeStatus entry for. The controller checks
// nothing itself: the VMI update validator judges the whole patch, so one
// bad disk holds back every other change of that VM. Any error of the patch
// (a denial, or a failed test because the VMI moved on) becomes the VM's
// Failure condition (v1.7.0 pkg/virt-controller/watch/vm/vm.go:3216).
func (v *vmController) handleDeclarative(ctx context.Context, vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) *syncError {
	if vmi == nil || vmi.Status.Phase != kubevirtv1.Running || vm.Spec.Template == nil {
		return nil // hotplug.go:52
	}
	if s := vm.Spec.UpdateVolumesStrategy; s != nil && *s == kubevirtv1.UpdateVolumesStrategyMigration {
		return nil // hotplug.go:38
	}
	vols := append(keptVMIVolumes(vm, vmi), newVMVolumes(vm, vmi)...)
	disks := append(keptVMIDisks(vm, vmi, vols), newVMDisks(vm, vmi, vols)...)
	if equality.Semantic.DeepEqual(vmi.Spec.Volumes, vols) && equality.Semantic.DeepEqual(vmi.Spec.Domain.Devices.Disks, disks) {
		return nil
	}
	patch, err := casPatch(
		casOp{"/spec/volumes", vmi.Spec.Volumes, vols, len(vmi.Spec.Volumes) > 0},
		casOp{"/spec/domain/devices/disks", vmi.Spec.Domain.Devices.Disks, disks, len(vmi.Spec.Domain.Devices.Disks) > 0},
	)
	if f := v.beforeDeclarativePatch.Load(); f != nil {
		(*f)(vmi)
	}
	if err == nil {
		err = v.c.kv.patch(ctx, resVMIs, vmi.Namespace, vmi.Name, "", types.JSONPatchType, patch, nil, &kubevirtv1.VirtualMachineInstance{})
	}
	if err != nil {
		v.c.log.V(2).Info("declarative VMI patch failed", "vm", vm.Namespace+"/"+vm.Name, "err", err)
		return &syncError{ReasonHotPlugVolumeError, fmt.Errorf("Error encountered while handling declarative hotplug volumes: %v", err)}
	}
	v.c.log.V(2).Info("declarative hotplug patched the VMI", "vm", vm.Namespace+"/"+vm.Name, "volumes", len(vols))
	return nil
}

// keptVMIVolumes drops the VMI's hotplug volumes that are missing from the
// VM spec or differ there (hotplug.go:95 filterHotplugVMIVolumes).
func keptVMIVolumes(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) []kubevirtv1.Volume {
	var out []kubevirtv1.Volume
	for _, v := range vmi.Spec.Volumes {
		if isHotpluggable(v) {
			mv, ok := volumeNamed(vm.Spec.Template.Spec.Volumes, v.Name)
			if !ok || (isHotpluggable(mv) && !equality.Semantic.DeepEqual(mv, v)) {
				continue
			}
		}
		out = append(out, *v.DeepCopy())
	}
	return out
}

// newVMVolumes are the VM's hotplug volumes the VMI has neither in its spec
// nor in its volumeStatus: a re-add waits for the old entry to go
// (hotplug.go:122 getNewHotplugVMVolumes).
func newVMVolumes(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) []kubevirtv1.Volume {
	var out []kubevirtv1.Volume
	for _, v := range vm.Spec.Template.Spec.Volumes {
		if !isHotpluggable(v) || HasVolume(vmi.Spec.Volumes, v.Name) {
			continue
		}
		if _, inStatus := FindVolumeStatus(vmi, v.Name); inStatus {
			continue
		}
		out = append(out, *v.DeepCopy())
	}
	return out
}

// keptVMIDisks keeps the VMI disks whose volume stays, and those whose
// volume went while the VM still has the disk and no volume of that name
// (hotplug.go:157 filterHotplugVMIDisks).
func keptVMIDisks(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, vols []kubevirtv1.Volume) []kubevirtv1.Disk {
	var out []kubevirtv1.Disk
	for _, d := range vmi.Spec.Domain.Devices.Disks {
		if !HasVolume(vols, d.Name) {
			vmDisk, diskOK := diskNamed(vm.Spec.Template.Spec.Domain.Devices.Disks, d.Name)
			volOK := HasVolume(vm.Spec.Template.Spec.Volumes, d.Name)
			if !diskOK || (volOK && (vmDisk.CDRom == nil || d.CDRom == nil)) {
				continue
			}
		}
		out = append(out, *d.DeepCopy())
	}
	return out
}

// newVMDisks are the VM disks of hotplug volumes in vols that the VMI lacks
// (hotplug.go:189 getNewHotplugVMDisks).
func newVMDisks(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, vols []kubevirtv1.Volume) []kubevirtv1.Disk {
	var out []kubevirtv1.Disk
	for _, d := range vm.Spec.Template.Spec.Domain.Devices.Disks {
		v, ok := volumeNamed(vols, d.Name)
		if _, has := diskNamed(vmi.Spec.Domain.Devices.Disks, d.Name); ok && isHotpluggable(v) && !has {
			out = append(out, *d.DeepCopy())
		}
	}
	return out
}

func volumeNamed(vols []kubevirtv1.Volume, name string) (kubevirtv1.Volume, bool) {
	for _, v := range vols {
		if v.Name == name {
			return v, true
		}
	}
	return kubevirtv1.Volume{}, false
}

func diskNamed(disks []kubevirtv1.Disk, name string) (kubevirtv1.Disk, bool) {
	for _, d := range disks {
		if d.Name == name {
			return d, true
		}
	}
	return kubevirtv1.Disk{}, false
}

// createVMI starts a VM: a VMI with the template spec, owned by the VM. The
// VMI controller takes it to Scheduled and then Running.
func (v *vmController) createVMI(ctx context.Context, vm *kubevirtv1.VirtualMachine) error {
	if vm.Spec.Template == nil {
		return nil
	}
	labels := maps.Clone(vm.Spec.Template.ObjectMeta.Labels)
	if labels == nil {
		labels = map[string]string{}
	}
	labels["kubevirt.io/created-by"] = string(vm.UID)
	vmi := &kubevirtv1.VirtualMachineInstance{
		TypeMeta: metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachineInstance"},
		ObjectMeta: metav1.ObjectMeta{
			Name: vm.Name, Namespace: vm.Namespace, Labels: labels,
			Annotations: vm.Spec.Template.ObjectMeta.Annotations,
			Finalizers:  []string{vmiFinalizer},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachine", Name: vm.Name, UID: vm.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Spec: *vm.Spec.Template.Spec.DeepCopy(),
	}
	err := v.c.kv.create(ctx, resVMIs, vm.Namespace, vmi, &kubevirtv1.VirtualMachineInstance{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	if err == nil {
		v.c.log.V(2).Info("VMI created", "vm", vm.Namespace+"/"+vm.Name)
	}
	return err
}
