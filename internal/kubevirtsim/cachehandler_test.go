package kubevirtsim

import "k8s.io/client-go/tools/cache"

func cacheHandler(f func(obj any)) cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    f,
		UpdateFunc: func(_, n any) { f(n) },
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			f(obj)
		},
	}
}
