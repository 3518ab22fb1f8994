package kubevirtsim

import (
	"context"
	"errors"
	"fmt"
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

type syncError struct {
	reason string
	err    error
}

func (e *syncError) Error() string { return e.err.Error() }

func (s *Sim) cachedVM(key string) (*kubevirtv1.VirtualMachine, bool) {
	obj, ok, _ := s.vmInf.GetStore().GetByKey(key)
	if !ok {
		return nil, false
	}
	return obj.(*kubevirtv1.VirtualMachine), true
}

func (s *Sim) cachedVMI(key string) (*kubevirtv1.VirtualMachineInstance, bool) {
	obj, ok, _ := s.vmiInf.GetStore().GetByKey(key)
	if !ok {
		return nil, false
	}
	return obj.(*kubevirtv1.VirtualMachineInstance), true
}

func vmRunning(vm *kubevirtv1.VirtualMachine) bool {
	if vm.Spec.RunStrategy != nil {
		return *vm.Spec.RunStrategy != kubevirtv1.RunStrategyHalted
	}
	return vm.Spec.Running != nil && *vm.Spec.Running
}

// syncVM is virt-controller's VM controller: start/stop, the legacy
// volumeRequests processing (§2), the declarative hotplug controller (§4) and
// the VM status.
func (s *Sim) syncVM(ctx context.Context, key string) (time.Duration, error) {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	log := s.log.WithValues("vm", key)
	cached, exists := s.cachedVM(key)
	vmi, vmiExists := s.cachedVMI(key)

	if !exists || cached.DeletionTimestamp != nil {
		// The VM is gone: its VMI shuts down (and outlives it for a while).
		if vmiExists && vmi.DeletionTimestamp == nil && (!exists || isControlledBy(vmi, cached.UID)) {
			log.V(2).Info("VM gone, deleting its VMI")
			if err := s.kv.delete(ctx, resVMIs, ns, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: ptr.To(vmi.UID)}}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
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
		if err := s.createVMI(ctx, vm); err != nil {
			return 0, err
		}
	case !running && vmiExists && vmi.DeletionTimestamp == nil:
		log.V(2).Info("stopping VM, deleting its VMI")
		if err := s.kv.delete(ctx, resVMIs, ns, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return 0, err
		}
	}

	legacy, declarative := s.gates()
	stored := cached // the VM as the API server has it
	var syncErr *syncError
	switch {
	case legacy && len(vm.Status.VolumeRequests) > 0:
		spec := vm.Spec.Template.Spec.DeepCopy()
		if err := s.handleVolumeRequests(ctx, vm, spec, vmi); err != nil {
			syncErr = &syncError{ReasonHotPlugVolumeError, fmt.Errorf("Error encountered while handling volume hotplug requests: %v", err)}
			break
		}
		if !equality.Semantic.DeepEqual(spec, &vm.Spec.Template.Spec) {
			upd := vm.DeepCopy()
			upd.Spec.Template.Spec = *spec
			out := &kubevirtv1.VirtualMachine{}
			if err := s.kv.update(ctx, resVMs, ns, name, "", upd, out); err != nil {
				log.V(2).Info("VM spec update failed", "err", err)
				syncErr = &syncError{ReasonFailedUpdateError, fmt.Errorf("Error encountered when trying to update vm according to add volume requests: %v", err)}
				break
			}
			log.V(2).Info("VM spec updated from volume requests")
			stored = out
		}
	case declarative:
		if err := s.handleDeclarative(ctx, vm, vmi); err != nil {
			var se *syncError
			if errors.As(err, &se) {
				syncErr = se
			} else {
				return 0, err // CAS conflict on the VMI: retry with backoff
			}
		}
	}

	if err := s.updateVMStatus(ctx, stored, vmi, legacy, syncErr); err != nil {
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
func (s *Sim) handleVolumeRequests(ctx context.Context, vm *kubevirtv1.VirtualMachine, spec *kubevirtv1.VirtualMachineInstanceSpec, vmi *kubevirtv1.VirtualMachineInstance) error {
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
			sleepCtx(ctx, s.jit.d(s.t.API))
			if serr := s.vmiVolumePatch(ctx, vmi.Namespace, vmi.Name, req, true); serr != nil {
				return serr
			}
			s.log.V(2).Info("VMI patched from volume request", "vm", vm.Namespace+"/"+vm.Name, "volume", requestName(req))
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

func (s *Sim) updateVMStatus(ctx context.Context, vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, legacy bool, syncErr *syncError) error {
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
	if err := s.kv.update(ctx, resVMs, vm.Namespace, vm.Name, "status", upd, &kubevirtv1.VirtualMachine{}); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		s.log.V(3).Info("VM status update failed", "vm", vm.Namespace+"/"+vm.Name, "err", err)
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

// handleDeclarative is the declarative hotplug controller (§4): while the VMI
// runs, remove VMI hotplug volumes missing from (or changed in) the VM spec
// and add VM hotplug volumes missing from the VMI that have no volumeStatus
// entry, in one compare-and-swap patch of the VMI. Volumes with a bad disk are
// skipped and reported as the VM's Failure condition.
func (s *Sim) handleDeclarative(ctx context.Context, vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) error {
	if vmi == nil || vmi.DeletionTimestamp != nil || vmi.Status.Phase != kubevirtv1.Running || vm.Spec.Template == nil {
		return nil
	}
	tmpl := &vm.Spec.Template.Spec
	vmVols := map[string]kubevirtv1.Volume{}
	vmDisks := map[string]kubevirtv1.Disk{}
	for _, d := range tmpl.Domain.Devices.Disks {
		vmDisks[d.Name] = d
	}
	for _, v := range tmpl.Volumes {
		vmVols[v.Name] = v
	}
	inStatus := map[string]bool{}
	for _, e := range vmi.Status.VolumeStatus {
		inStatus[e.Name] = true
	}
	next := vmi.Spec.DeepCopy()
	changed := false
	var badErrs []string

	// Removals.
	var keep []kubevirtv1.Volume
	removed := map[string]bool{}
	for _, v := range next.Volumes {
		if isHotpluggable(v) {
			mv, ok := vmVols[v.Name]
			vd, dok := vmDisks[v.Name]
			if !ok || !equality.Semantic.DeepEqual(mv, v) || !dok || !equality.Semantic.DeepEqual(vd, diskOf(next, v.Name)) {
				removed[v.Name] = true
				changed = true
				continue
			}
		}
		keep = append(keep, v)
	}
	if changed {
		var disks []kubevirtv1.Disk
		for _, d := range next.Domain.Devices.Disks {
			if !removed[d.Name] {
				disks = append(disks, d)
			}
		}
		next.Volumes, next.Domain.Devices.Disks = keep, disks
	}
	// Additions.
	have := map[string]bool{}
	for _, v := range next.Volumes {
		have[v.Name] = true
	}
	for _, v := range tmpl.Volumes {
		if !isHotpluggable(v) || have[v.Name] || inStatus[v.Name] || removed[v.Name] {
			continue
		}
		d, ok := vmDisks[v.Name]
		if !ok {
			badErrs = append(badErrs, fmt.Sprintf("disk %s does not exist", v.Name))
			continue
		}
		if c := s.validateHotplugDisk(&d, v.Name, "Hotplug configuration", ""); c != nil {
			badErrs = append(badErrs, c[0].Message)
			continue
		}
		next.Volumes = append(next.Volumes, v)
		next.Domain.Devices.Disks = append(next.Domain.Devices.Disks, d)
		changed = true
	}
	if changed {
		patch, err := casPatch(
			casOp{"/spec/volumes", vmi.Spec.Volumes, next.Volumes, len(vmi.Spec.Volumes) > 0},
			casOp{"/spec/domain/devices/disks", vmi.Spec.Domain.Devices.Disks, next.Domain.Devices.Disks, len(vmi.Spec.Domain.Devices.Disks) > 0},
		)
		if err != nil {
			return err
		}
		if err := s.kv.patch(ctx, resVMIs, vmi.Namespace, vmi.Name, "", types.JSONPatchType, patch, nil, &kubevirtv1.VirtualMachineInstance{}); err != nil {
			s.log.V(2).Info("declarative VMI patch failed", "vm", vm.Namespace+"/"+vm.Name, "err", err)
			return err
		}
		s.log.V(2).Info("declarative hotplug patched the VMI", "vm", vm.Namespace+"/"+vm.Name, "volumes", len(next.Volumes))
	}
	if len(badErrs) > 0 {
		msg := badErrs[0]
		for _, m := range badErrs[1:] {
			msg += ", " + m
		}
		return &syncError{ReasonHotPlugVolumeError, fmt.Errorf("Error encountered while handling declarative hotplug volumes: %s", msg)}
	}
	return nil
}

func diskOf(spec *kubevirtv1.VirtualMachineInstanceSpec, name string) kubevirtv1.Disk {
	for _, d := range spec.Domain.Devices.Disks {
		if d.Name == name {
			return d
		}
	}
	return kubevirtv1.Disk{}
}

// createVMI starts a VM: a VMI with the template spec, owned by the VM. The
// VMI controller takes it to Scheduled and then Running.
func (s *Sim) createVMI(ctx context.Context, vm *kubevirtv1.VirtualMachine) error {
	if vm.Spec.Template == nil {
		return nil
	}
	labels := map[string]string{}
	for k, v := range vm.Spec.Template.ObjectMeta.Labels {
		labels[k] = v
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
	err := s.kv.create(ctx, resVMIs, vm.Namespace, vmi, &kubevirtv1.VirtualMachineInstance{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	if err == nil {
		s.log.V(2).Info("VMI created", "vm", vm.Namespace+"/"+vm.Name)
	}
	return err
}
